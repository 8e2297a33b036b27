"""Scale-out: tensor parallelism over torch.distributed (``parallel``), checkpointed layers whose
kept input is split across ranks (``tp_checkpoint``) and layer-wise ``--device_map`` placement in one
process (``device_map``). Above ``model``; the arch adapters describe their shards with its types.
"""
