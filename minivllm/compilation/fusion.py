"""Graph passes inductor runs on minivllm's compiled forwards (post-grad, before lowering).

`LinearSiluMulFusionPass`: `silu_and_mul(cpu_linear(x, w, b))` -> `cpu_linear_silu_mul(x, w, b)`
when the linear's output feeds nothing else (the MLP's gate_up_proj + act_fn). The fused op
applies the activation to each output block while it is still in registers, instead of writing
the [T, 2 * intermediate] projection out and reading it back (a batch-64 decode step of the
default model: ~3 ms less).
"""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


class LinearSiluMulFusionPass(CustomGraphPass):
    """Rewrites each fusable (linear, SiluAndMul) pair in place; `fused` counts those of the
    last graph."""

    def __init__(self) -> None:
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fused = 0
        # The ops are looked up, not imported: a graph can hold them only once the model's layers
        # (model_executor/kernels/) defined them, and compilation sits below model_executor.
        if not hasattr(torch.ops.minivllm, "cpu_linear_silu_mul"):
            return
        linear = torch.ops.minivllm.cpu_linear.default
        act = torch.ops.minivllm.silu_and_mul.default
        fused_op = torch.ops.minivllm.cpu_linear_silu_mul.default
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not act:
                continue
            src = node.args[0]
            if (not isinstance(src, torch.fx.Node) or src.op != "call_function"
                    or src.target is not linear or len(src.users) != 1):
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(fused_op, src.args, dict(src.kwargs))
            # The output is the activation's; the inputs (and inductor's record of their eager
            # layouts, "eager_input_vals") are the linear's.
            fused.meta.update(src.meta)
            if "val" in node.meta:
                fused.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            graph.erase_node(src)
            self.fused += 1

    def uuid(self) -> bytes:
        # inductor's FX-graph cache keys compiled graphs on this: a change here recompiles.
        return get_hash_for_files((__file__,))
