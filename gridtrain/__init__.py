"""gridtrain: plan and run multi-dimensional parallel pretraining of Llama-style models."""
