# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Snapshot of the state a training step changes, and its exact restore (used by warmup.py).

Device tensors are staged in host memory and copied back in place, so no second device copy is
made; optimizer state that did not exist at the snapshot (a fresh run) is deleted again.

Where an upstream object's own API restores a live object exactly, it is used: the grad scaler's
state_dict()/load_state_dict(), the CUDA RNG tracker's get_states()/set_states(), the python,
numpy and torch generators' get/set state, and DistributedDataParallel.
reset_grad_ready_calibration() (patch 0001) for the grad-ready calibration. Where it does not,
the attributes are copied (``vars()``) or the tensors staged:

- OptimizerParamScheduler.load_state_dict() is a checkpoint load into a fresh scheduler: it adds
  the saved num_steps to the current one (``step(increment=num_steps)``) and logs every field, so
  the scheduler's attributes (plain values) are copied instead;
- the torch optimizers' load_state_dict() casts each state tensor to its param's dtype and
  device (new tensors where they differ, e.g. bf16 moments of fp32 main params) and drops the
  state created after the snapshot, so their state tensors are staged and written back in place,
  and the param groups' values copied;
- RerunStateMachine.state_dict() is a checkpoint of a pending rerun (None while none is pending
  or the machine is disabled) and leaves out the validation statistics a step feeds, so its
  attributes are copied;
- the args counters and the modules' training flags have no state_dict().
"""

import copy
import random

import numpy as np
import torch

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

# Counters on the global args that train_step() or train() advance.
ARGS_COUNTERS = ('iteration', 'curr_iteration', 'consumed_train_samples', 'skipped_train_samples')
ARGS_COUNTERS += ('consumed_valid_samples', 'num_floating_point_operations_so_far')
# Optimizers whose lazily created state is all zeros (moments and step count).
_ZERO_INITIALIZED = (torch.optim.Adam, torch.optim.AdamW)


def sub_optimizers(optimizer) -> list:
    """The optimizers of a ChainedOptimizer, or ``[optimizer]``."""
    return list(getattr(optimizer, 'chained_optimizers', None) or [optimizer])


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _copied(value):
    """A deep copy where one can be made (plain values, containers, tensors), else the value."""
    try:
        return copy.deepcopy(value)
    except Exception:  # pylint: disable=broad-except
        return value


def _is_state_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


class TrainingStateSnapshot:
    """Everything a training step changes, captured now; restore() puts it back.

    Args:
        model: list of DDP model chunks.
        optimizer: the Megatron optimizer.
        opt_param_scheduler: the OptimizerParamScheduler, or None.
        args: Megatron global args (its counters are restored).
    """

    def __init__(self, model, optimizer, opt_param_scheduler, args):
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        self.model, self.optimizer, self.scheduler, self.args = model, optimizer, None, args
        self.staged, self.nbytes = {}, 0  # id(tensor) -> (tensor, its data, host copy); bytes
        for chunk in model:
            for param in chunk.parameters():
                self._stage(param)
            # DDP shadows Module.buffers() with its list of grad buffers; call the Module method.
            for buffer in torch.nn.Module.buffers(chunk):
                self._stage(buffer)
        self.groups, self.states, self.scalers = [], [], []
        for opt in sub_optimizers(optimizer):
            inner = opt.optimizer  # the torch optimizer owning the main params and their state
            groups = [{k: _clone(v) for k, v in group.items()} for group in inner.param_groups]
            self.groups.append((inner, groups))
            for param in (p for group in inner.param_groups for p in group['params']):
                self._stage(param)  # fp32 main params (or the model params themselves)
                state = {
                    k: v if _is_state_tensor(v) else _clone(v)
                    for k, v in inner.state.get(param, {}).items()
                }
                for value in filter(_is_state_tensor, state.values()):
                    self._stage(value)  # restored in place; the tensor object is kept
                self.states.append((inner, param, state))
            scaler = getattr(opt, 'grad_scaler', None)  # None for fp32 and bf16
            if scaler is not None and all(s is not scaler for s, _ in self.scalers):
                state = {k: _clone(v) for k, v in scaler.state_dict().items()}
                self.scalers.append((scaler, state))
        if opt_param_scheduler is not None:
            # Its attributes are plain values (num_steps, lr/wd bounds and styles).
            self.scheduler = (opt_param_scheduler, dict(vars(opt_param_scheduler)))
        self.counters = {k: getattr(args, k) for k in ARGS_COUNTERS if hasattr(args, k)}
        self.training = [(m, m.training) for chunk in model for m in chunk.modules()]
        # Bucket groups whose grad-ready calibration real steps recorded before the warmup.
        self.calibrated = {group for group in _bucket_groups(model) if not group.is_first_batch}
        # The rerun state machine's whole state: its iteration and state, and the statistics a
        # step's validation feeds (first_iteration_complete, spiky-loss counts and maxima).
        self.rerun = get_rerun_state_machine()
        self.rerun_state = {k: _copied(v) for k, v in vars(self.rerun).items()}
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies to pinned host memory
        # python, numpy, torch CPU and device, and the Megatron CUDA RNG tracker: a copy of its
        # dict of states, each of which fork() replaces rather than writes into (a graph-safe
        # tracker, whose states are live generator handles, is refused by the warmup).
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.rng += (torch.cuda.get_rng_state(), get_cuda_rng_tracker().get_states())

    def restore(self, keep_calibration: bool = False, routed=()) -> tuple:
        """Put everything back; returns (DDP bucket groups reset, collectives drained, bucket
        groups whose grad-ready calibration was kept). ``keep_calibration``: the steps ran as
        train()'s do, so the counts they recorded are the ones a first real step would record,
        except in bucket groups holding a param in ``routed``, which are reset.

        Every part runs even if an earlier one raises (e.g. draining a collective after a
        communication error), so the host-staged state is always put back; the first failure is
        raised at the end.
        """
        failures, result = [], [(0, 0, 0)]
        for part in (
            lambda: result.append(
                reset_ddp_grad_ready_calibration(
                    self.model, keep_calibration, self.calibrated, routed
                )
            ),
            self._zero_grads,
            self._restore_staged,
            self._restore_optimizer,
            self._restore_counters,
            self._restore_rng,
        ):
            try:
                part()
            except Exception as exc:  # pylint: disable=broad-except
                failures.append(exc)
        if failures:
            raise failures[0]
        return result[-1]

    def _stage(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self.staged:
            pin = tensor.device.type == 'cuda' and torch.cuda.is_available()
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device='cpu', pin_memory=pin)
            host.copy_(tensor.detach(), non_blocking=pin)
            # tensor.data as well: a step may rebind it (the MoE router casts its expert bias to
            # fp32 in forward); holding it costs nothing while it is not rebound.
            self.staged[id(tensor)] = (tensor, tensor.data, host)
            self.nbytes += host.numel() * host.element_size()

    def _restore_staged(self) -> None:
        with torch.no_grad():
            for tensor, data, host in self.staged.values():
                if tensor.data_ptr() != data.data_ptr() or tensor.dtype != data.dtype:
                    tensor.data = data
                data.copy_(host, non_blocking=host.is_pinned())

    def _zero_grads(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        for opt in sub_optimizers(self.optimizer):
            opt.zero_grad(set_to_none=True)

    def _restore_optimizer(self) -> None:
        for inner, param, saved in self.states:
            if not saved:  # created by the steps (a fresh run)
                state = inner.state.get(param, {})
                if type(inner) in _ZERO_INITIALIZED and all(
                    isinstance(value, torch.Tensor) for value in state.values()
                ):
                    # Kept allocated: torch's Adam(W) creates zeros and step 0, so zeroing in
                    # place is its fresh state, without the allocations in the first real step.
                    for value in state.values():
                        value.zero_()
                else:  # the next step initializes it as without the warmup
                    inner.state.pop(param, None)
                continue
            inner.state[param].clear()
            inner.state[param].update(
                {k: v if _is_state_tensor(v) else _clone(v) for k, v in saved.items()}
            )
        for inner, groups in self.groups:
            for group, saved in zip(inner.param_groups, groups):
                group.clear()
                group.update({k: _clone(v) for k, v in saved.items()})  # 'params': the same list
        for scaler, state in self.scalers:
            scaler.load_state_dict({k: _clone(v) for k, v in state.items()})
        if self.scheduler is not None:
            vars(self.scheduler[0]).update(self.scheduler[1])

    def _restore_counters(self) -> None:
        for key, value in self.counters.items():
            setattr(self.args, key, value)
        for module, training in self.training:
            module.training = training
        vars(self.rerun).clear()
        vars(self.rerun).update({k: _copied(v) for k, v in self.rerun_state.items()})
        _clear_loss_trackers()

    def _restore_rng(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        torch.cuda.set_rng_state(self.rng[3])
        get_cuda_rng_tracker().set_states(dict(self.rng[4]))


def _bucket_groups(model) -> list:
    return [g for chunk in model for g in chunk.bucket_groups + chunk.expert_parallel_bucket_groups]


def reset_ddp_grad_ready_calibration(
    model, keep_calibration: bool = False, calibrated=(), routed=()
) -> tuple:
    """Drain every DDP bucket group and reset its grad-ready calibration
    (DistributedDataParallel.reset_grad_ready_calibration, patch 0001).

    Args:
        model: list of DDP model chunks.
        keep_calibration: keep the golden counts that the steps recorded, so that the first real
            step overlaps its grad reduce as later ones do.
        calibrated: the bucket groups whose counts real steps recorded before the warmup; kept
            whatever ``keep_calibration`` says.
        routed: the params whose counts may depend on the routing; the bucket groups holding
            one are reset unless in ``calibrated``.

    Returns:
        (bucket groups reset, collectives drained, bucket groups with a calibration after it).
    """
    reset = drained = 0
    for chunk in model:
        groups, awaited = chunk.reset_grad_ready_calibration(
            keep_calibration, recalibrate_params=routed, keep_bucket_groups=calibrated
        )
        reset, drained = reset + groups, drained + awaited
    return reset, drained, sum(not group.is_first_batch for group in _bucket_groups(model))


def _clear_loss_trackers() -> None:
    """Drop the auxiliary losses the steps left in the MoE, MTP and DSA-indexer trackers."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    get_moe_metrics_tracker().clear()
    helpers = [MTPLossLoggingHelper]
    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        helpers.append(DSAIndexerLossLoggingHelper)
    except ImportError:  # a release without DeepSeek sparse attention
        pass
    for helper in helpers:
        if helper.tracker:
            # Releases split the clean-up differently (dev's clean_metrics_in_tracker leaves
            # the per-token loss sums that clean_loss_in_tracker zeroes): call each there is.
            for name in ('clean_loss_in_tracker', 'clean_metrics_in_tracker'):
                if hasattr(helper, name):
                    getattr(helper, name)()
