# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Re-arming the grad-ready calibration of a bucket group (overlap_grad_reduce).

A bucket group records, in its first batch, how often each param registers its grad as ready
(the golden counts); later batches dispatch the grad reduce when their counts match.
"""

import torch


class GradReadyCalibration:
    """Methods of _ParamAndGradBucketGroup that return its grad-ready calibration to its state at
    construction."""

    def reset_grad_ready_calibration(self, keep_golden_counts: bool = False) -> int:
        """
        Return grad-ready calibration to its state at construction, so that the next batch
        records fresh golden per-param counts. Needed when earlier batches ran with a different
        microbatch structure (e.g. a warm-up step without no_sync_func). Call it outside
        no_sync(). Collectives still in flight are completed first: an outstanding param
        all-gather as finish_param_sync completes it (without dispatching the next one), and an
        outstanding grad reduce as finish_grad_sync completes it.

        Args:
            keep_golden_counts (bool, optional): drain and clear the per-batch state, but keep
                the golden counts recorded so far (if any), for earlier batches that ran with
                the real microbatch structure. Defaults to False.

        Returns:
            int: number of outstanding collectives (param all-gather, grad reduce) awaited.
        """
        drained = 0
        if self.param_gather_handle is not None:
            self.finish_param_sync(skip_next_bucket_dispatch=True)
            drained += 1
        self.param_gather_dispatched = False
        if self.ddp_config.num_distributed_optimizer_instances > 1:
            # Reduces run synchronously on the communication stream, without a handle.
            torch.cuda.current_stream().wait_stream(self.communication_stream)
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
            self._copy_back_extra_main_grads()
            drained += 1
        if not keep_golden_counts:
            self.golden_per_param_grad_ready_counts = {}
            self.is_first_batch = True
        # Drop this batch's counts, so that reset() clears the per-batch state without recording
        # them as golden.
        self.per_param_grad_ready_counts = {}
        self.reset()
        return drained
