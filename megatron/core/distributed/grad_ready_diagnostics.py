# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Diagnostics for bucket groups whose grad reduce is never dispatched (overlap_grad_reduce).

Only called on error paths: building these messages costs nothing while training runs normally.
"""

from typing import List

import torch

_MAX_LISTED = 8

_MISSING_CAUSE = (
    "Likely cause: a parameter that requires grad received no gradient in backward: it is "
    "defined but not used in forward (or only in some batches, e.g. a conditional branch or "
    "layer), its output does not reach the loss (detached), or requires_grad was turned off "
    "after the model was wrapped in DistributedDataParallel. Remedy: use the parameter in "
    "every forward pass (e.g. add 0 * param.sum() to the output), or set requires_grad=False "
    "on it on every rank before wrapping the model in DistributedDataParallel, or train with "
    "overlap_grad_reduce=False."
)

_FEWER_CAUSE = (
    "Likely cause: the calibration (first) batch counted more registrations than this one: it "
    "ran without config.no_sync_func (every microbatch registered, e.g. a warm-up step run "
    "before train() installed its callbacks), or a parameter went through backward more often "
    "in it. Remedy: install config.no_sync_func before the first batch, or recalibrate "
    "(DistributedDataParallel.reset_grad_ready_calibration() where available)."
)


def _rank() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank {torch.distributed.get_rank()}"
    return "this process"


class GradReadyDiagnostics:
    """The messages of _ParamAndGradBucketGroup for a grad reduce that is never dispatched,
    naming the params that did not register their grads."""

    def _describe_params(self, params: List[torch.nn.Parameter], counts=None) -> str:
        names = getattr(self, 'param_to_name', None) or {}
        items = []
        for param in params[:_MAX_LISTED]:
            item = f"{names.get(param, '<unnamed>')} {tuple(param.shape)}"
            if counts is not None:
                golden = self.golden_per_param_grad_ready_counts.get(param, 0)
                item += f" ({counts.get(param, 0)} of {golden})"
            items.append(item)
        if len(params) > _MAX_LISTED:
            items.append(f"... and {len(params) - _MAX_LISTED} more")
        return ", ".join(items)

    def missing_grad_ready_message(self, calibrating: bool) -> str:
        """
        Explain why this bucket group's grad reduce was never dispatched.

        Args:
            calibrating: True when the first (calibration) batch ended without a registration
                from every param (reset()); False when finish_grad_sync found no reduce in
                flight.

        Returns:
            str: the error message, naming the parameters that did not report.
        """
        counts = self.per_param_grad_ready_counts
        params = [param for bucket in self.buckets for param in bucket.params_list]
        missing = [param for param in params if param not in counts]
        fewer = []
        if not calibrating:
            golden = self.golden_per_param_grad_ready_counts
            fewer = [p for p in params if p in counts and counts[p] < golden.get(p, 0)]
        reported = f"{len(counts)}/{len(self.params)} params have grad available"
        if calibrating:
            head = (
                f"Grad-ready calibration failed: in the first batch only {reported} in this "
                "bucket group. With overlap_grad_reduce=True a bucket group's grad reduce is "
                "dispatched once every param in it has registered its grad as ready, so it "
                "would never be dispatched."
            )
        else:
            head = (
                f"Communication call has not been issued for this bucket ({reported}). With "
                "overlap_grad_reduce=True a bucket group's grad reduce is dispatched once every "
                "param in it has registered its grad as ready as often as in the first "
                "(calibration) batch."
            )
        parts = [head]
        if missing:
            parts.append(
                f"On {_rank()}, {len(missing)} param(s) did not register a grad in this batch: "
                f"{self._describe_params(missing)}. {_MISSING_CAUSE}"
            )
        if fewer:
            parts.append(
                f"On {_rank()}, {len(fewer)} param(s) registered fewer times than in the "
                "calibration batch (this batch of calibrated): "
                f"{self._describe_params(fewer, counts)}. {_FEWER_CAUSE}"
            )
        return " ".join(parts)
