"""What serving engines do: layer-id rules, HTTP clients."""
