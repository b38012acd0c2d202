"""Pipeline x data-parallel training with compressed communication (Optimus-CC, paper 003).

    import torch.distributed as dist
    from hipress.pipeline import Pipeline

    dist.init_process_group("gloo")                  # pp * dp ranks
    pipe = Pipeline(model, lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn, pp=2, dp=2, micro_batches=4,
                    tied=[("embed.weight", "head.weight")], fuse_embedding=True,
                    backward_compression="powersgd", backward_compression_kwargs={"rank": 8},
                    compress_stages=1, dp_compression="powersgd")
    loss = pipe.step(inputs, targets)                # this replica's batch; loss on the last stage

Modules: ``layout`` (ranks to stages and replicas, layers to stages), ``schedule`` (1F1B and
the epilogue), ``compressed_backward`` (activation-gradient compression with lazy error
propagation), ``tied`` (tied-parameter sync, unfused or fused), ``trainer`` (the Pipeline).
See docs/pipeline.md.
"""
from hipress.pipeline.layout import Layout, split_stage, stage_bounds
from hipress.pipeline.trainer import Pipeline

__all__ = ["Layout", "Pipeline", "split_stage", "stage_bounds"]
