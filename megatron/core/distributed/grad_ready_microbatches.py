# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Grad-ready calibration across steps with different numbers of microbatches.

With overlap_grad_reduce, a bucket group dispatches its grad reduce when the per-param grad-ready
counts of the batch equal the golden counts recorded in the first (calibration) batch. Without
no_sync_func every microbatch's backward registers, so those counts are proportional to the
number of microbatches. The schedules announce, before each forward/backward call, how many of
its microbatches run their backward outside no_sync(); a bucket group compares that with the
calibration batch and recalibrates (dispatching this batch's reduce in finish_grad_sync) when
they differ.
"""


class GradReadyMicrobatches:
    """Methods of _ParamAndGradBucketGroup that track the microbatches of each forward/backward
    call (grad_ready_microbatches, golden_grad_ready_microbatches) and recalibrate."""

    def announce_grad_ready_microbatches(self, num_microbatches: int) -> None:
        """
        Record that the next forward/backward call of the current batch runs the backward of
        `num_microbatches` microbatches outside no_sync(), and recalibrate if the batch no
        longer matches the calibration batch.

        Args:
            num_microbatches (int): microbatches of the call whose backward registers grads.
        """
        if not self.ddp_config.overlap_grad_reduce:
            return
        calls = self.grad_ready_microbatches
        if calls and not self.is_first_batch:
            # Another forward/backward call for the same batch (no zero_grad_buffer() between).
            dispatched = self.per_param_grad_ready_counts == self.golden_per_param_grad_ready_counts
            if self.grad_reduce_handle is not None or (
                dispatched and not self.grad_reduce_finished
            ):
                raise RuntimeError(self._reduce_in_flight_message(num_microbatches))
        calls = calls + (num_microbatches,)
        self.grad_ready_microbatches = calls
        golden = self.golden_grad_ready_microbatches
        if self.grad_reduce_finished or not (
            self.is_first_batch or (golden is not None and calls == golden[: len(calls)])
        ):
            # This batch differs from the calibration batch, or a finish_grad_sync already
            # reduced its earlier calls: it recalibrates, keeping the grad-ready counts of its
            # earlier calls, and the next finish_grad_sync reduces the whole buffer (again, as
            # without overlap_grad_reduce).
            self.is_first_batch = True
            self.golden_per_param_grad_ready_counts = {}
            self.grad_reduce_finished = False

    def grad_ready_batch_ended_early(self) -> bool:
        """
        True when the current batch's forward/backward calls are a strict prefix of the
        calibration batch's: its grad-ready counts cannot have reached the golden ones, and
        finish_grad_sync dispatches the reduce itself, as in the calibration batch.
        """
        calls = self.grad_ready_microbatches
        golden = self.golden_grad_ready_microbatches
        return bool(calls) and golden is not None and len(calls) < len(golden)

    def _reduce_in_flight_message(self, num_microbatches: int) -> str:
        calls = self.grad_ready_microbatches
        return (
            f"A forward/backward call with {num_microbatches} microbatch(es) was started for a "
            f"batch whose grad reduce was already dispatched with overlap_grad_reduce: its "
            f"earlier calls (microbatches whose backward registers grads: {list(calls)}) matched "
            f"the calibration batch ({list(self.golden_grad_ready_microbatches)}), and gradients "
            "of this call would miss that reduce. Gradients accumulated over several "
            "forward_backward_func calls without zero_grad_buffer() in between are only reduced "
            "correctly when the calls differ from the calibration batch's from the first call "
            "on. Remedy: pass all microbatches of the step to one forward_backward_func call, or "
            "call DistributedDataParallel.reset_grad_ready_calibration() before the step's first "
            "call."
        )
