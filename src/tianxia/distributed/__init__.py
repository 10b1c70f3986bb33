"""Tensor parallelism over ``torch.distributed`` (gloo on CPU): the sharding transform
(:mod:`.sharding`) and the worker processes that run the shards (:mod:`.tensor_parallel`)."""
