# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Mean-loss gradient scaling of expert params when expert GTP differs from dense GTP."""

from typing import Dict


def expert_gtp_scaling_correction(process_group_dict: Dict) -> float:
    """Return EGTP / GTP, the factor that DDP's expert pre-scale needs on top of 1 / dp_cp.

    Under the mean loss DDP pre-scales every grad by 1 / dp_cp_group.size(), and that group
    excludes the dense gtp_remat axis (GTP ranks hold distinct data). Dense params get the
    missing 1 / GTP back from GTP's own averaging (the gtp_remat reduce-scatter mean for sharded
    weights, the gtp_remat AVG in finalize_model_grads for replicated ones); expert params get it
    back over the expert gtp_remat axis, that is 1 / EGTP. Where EGTP != GTP their grads keep a
    factor GTP / EGTP.
    """
    sizes = []
    for key in ('gtp_remat_group', 'expt_gtp_remat_group'):
        group = process_group_dict.get(key)
        sizes.append(group.size() if group is not None else 1)
    gtp, egtp = sizes
    return egtp / gtp
