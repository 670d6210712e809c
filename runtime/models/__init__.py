"""Model definitions (Hugging Face parameter names) and their configs."""
