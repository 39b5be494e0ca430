"""Hugging Face checkpoints: the mapping spec, safetensors I/O, export, import and conversion
validation."""
