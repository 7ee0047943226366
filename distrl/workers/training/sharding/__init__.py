"""FSDP2 sharding of an HF causal LM across the learner group (`learner.strategy: fsdp`). Plain functions, no Ray.

Every parameter, its gradient and its AdamW moments live as a `DTensor` sharded on dim 0 over the M learners
(`torch.distributed.fsdp.fully_shard`, one unit per decoder layer plus the root for embeddings, final norm and
head), so a learner holds ~1/M of the parameter + gradient + optimizer bytes of a replica.

- `wrap`: `shard` a built model (mixed precision, CPU offload, gradients summed rather than averaged).
- `load`: `load_sharded_causal_lm` (and `load_sharded`, any HF auto class, e.g. the critic's value model) builds on
  the meta device and each rank reads only its slices of the HF files.
- `grads`: `clip_grad_norm_`, the replica's global norm over sharded or plain gradients.
- `export`: `gather_bucket` (weight sync, bucket by bucket, every rank taking part) and
  `save_hf` (an HF folder that transformers and vLLM load).
- `state`: `save` / `load` of model + optimizer with torch.distributed.checkpoint, each rank writing its shards.

Every function here that touches sharded tensors is a collective: every rank of the group must call it, in the same
order, with the same arguments.
"""

from distrl.workers.training.sharding.export import gather_bucket, local_pieces, save_hf
from distrl.workers.training.sharding.grads import clip_grad_norm_
from distrl.workers.training.sharding.load import load_sharded, load_sharded_causal_lm
from distrl.workers.training.sharding.state import load, save
from distrl.workers.training.sharding.wrap import decoder_layer_classes, learner_mesh, own_rows, shard, sync_gradients

__all__ = ["clip_grad_norm_", "decoder_layer_classes", "gather_bucket", "learner_mesh", "load", "load_sharded",
           "load_sharded_causal_lm", "local_pieces", "own_rows", "save", "save_hf", "shard", "sync_gradients"]
