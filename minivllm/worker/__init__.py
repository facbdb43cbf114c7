"""Worker side: the model runner and the sampler."""
