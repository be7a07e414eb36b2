"""Model locations (a path, hf://, s3://, https://) and the files that make a model folder, resolved for
serving."""
