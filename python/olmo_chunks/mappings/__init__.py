"""Built-in mapping specs (JSON) between OLMo-core-style native names and Hugging Face models."""
