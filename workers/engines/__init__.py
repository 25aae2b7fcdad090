"""Engine adapters: the emulated engine and vLLM."""
