"""Engine core: requests, KV block management, scheduling, detokenisation and the step loop."""
