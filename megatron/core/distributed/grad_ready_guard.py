# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Diagnostics for DDP grad-ready calibration mismatches (see register_grad_ready)."""

import torch


class GradReadyGuard:
    """The message of _ParamAndGradBucketGroup.register_grad_ready for a registration that the
    calibrated counts do not allow (built only when it raises)."""

    def grad_ready_mismatch_message(self, param: torch.nn.Parameter) -> str:
        """
        Explain a grad-ready registration that the calibrated counts do not allow.

        Args:
            param: the parameter whose grad was registered as ready.

        Returns:
            str: the error message.
        """
        count = self.per_param_grad_ready_counts[param]
        golden = self.golden_per_param_grad_ready_counts.get(param, 0)
        in_flight = self.grad_reduce_handle is not None
        return (
            f"Grad-ready calibration mismatch: a param of shape {tuple(param.shape)} registered "
            f"its grad as ready {count} time(s) in this batch, but the calibration (first) batch "
            f"recorded {golden} (grad reduce in flight: {in_flight}). The grad reduce is "
            "dispatched when the counts match, so gradients accumulated after it would be lost. "
            "Likely origin: steps run without no_sync_func (e.g. a warm-up before train() "
            "installed its callbacks) or without finish_grad_sync, so batches counted different "
            "microbatches. Remedy: install config.no_sync_func for every step, or call "
            "DistributedDataParallel.reset_grad_ready_calibration() after the mismatching steps."
        )
