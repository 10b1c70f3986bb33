"""Tensor parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPUs): each rank's split
of the model (:mod:`.sharding`) and the worker processes that run the shards (:mod:`.tensor_parallel`)."""
