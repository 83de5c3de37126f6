"""Optimizer state and step cost, as torch.optim allocates them.

State per parameter, in the parameter's dtype (torch creates state with ``zeros_like(param)``):
- AdamW: ``exp_avg`` and ``exp_avg_sq`` (2 tensors) plus a scalar ``step``;
- SGD with momentum: ``momentum_buffer`` (1 tensor);
- SGD: nothing.

Step temporaries (torch/optim/adam.py ``_multi_tensor_adam``): the foreach path allocates
``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, one parameter-sized tensor per parameter,
alive until ``_foreach_addcdiv_``; the fused kernel updates in place. docs/references.md "Bytes per parameter": a 7B Llama in
fp32 peaks at 125.8 GiB with foreach vs 100.7 GiB fused (params + grads + 2 moments (+ one
param-sized temporary)). SGD foreach without weight decay updates in place.

Step traffic (element reads + writes per parameter), for the memory-bound roofline:
- AdamW fused: read p, g, m, v; write p, m, v = 7;
- AdamW foreach: mul_(p) 2, lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 3, sqrt(v) 2, div_ 2,
  add_ 2, addcdiv_(p, m, tmp) 4 = 20;
- SGD momentum: mul_(buf) 2, add_(buf, g) 3, add_(p, buf) 3 = 8 (fused 4: read p, g, buf; write p, buf = 5);
- SGD: add_(p, g) 3.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner.model.config import OptimizerImpl, OptimizerKind


class OptimizerSpec(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: OptimizerKind
    impl: OptimizerImpl
    state_tensors_per_param: int
    step_temporaries_per_param: int  # param-sized temporaries alive during step()
    traffic_elements_per_param: int  # element reads + writes per parameter element
    kernels_per_tensor_list: int  # foreach ops (each one multi-tensor launch per chunk)
    device_step_scalar: bool  # fused keeps a scalar `step` tensor per parameter on the device


_SPECS = {
    (OptimizerKind.ADAMW, OptimizerImpl.FOREACH): (2, 1, 20, 8, False),
    (OptimizerKind.ADAMW, OptimizerImpl.FUSED): (2, 0, 7, 1, True),
    (OptimizerKind.SGD_MOMENTUM, OptimizerImpl.FOREACH): (1, 0, 8, 3, False),
    (OptimizerKind.SGD_MOMENTUM, OptimizerImpl.FUSED): (1, 0, 5, 1, False),
    (OptimizerKind.SGD, OptimizerImpl.FOREACH): (0, 0, 3, 1, False),
    (OptimizerKind.SGD, OptimizerImpl.FUSED): (0, 0, 3, 1, False),
}


def optimizer_spec(kind: OptimizerKind, impl: OptimizerImpl) -> OptimizerSpec:
    state, temps, traffic, kernels, device_step = _SPECS[(kind, impl)]
    return OptimizerSpec(
        kind=kind,
        impl=impl,
        state_tensors_per_param=state,
        step_temporaries_per_param=temps,
        traffic_elements_per_param=traffic,
        kernels_per_tensor_list=kernels,
        device_step_scalar=device_step,
    )
