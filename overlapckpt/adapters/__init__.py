"""Framework adapters (Lightning, Hugging Face, TorchTitan): thin layers over ``Checkpointer``, each importing its framework lazily."""
