"""The Hugging Face Hub source, through huggingface_hub and its cache: fetches, its environment, its errors,
and the check of each file against the hash the Hub vouched for."""
