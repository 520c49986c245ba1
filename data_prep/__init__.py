"""The data stages of eagle3_train: prepare, dump, standardize."""
