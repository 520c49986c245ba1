"""Export for serving, and the contract check of an export."""
