"""Automatic fusion under torch.compile: an Inductor pass that finds all_reduce -> [residual add]
-> RMSNorm -> [FP8 quant] in a compiled tensor-parallel model and calls distnorm instead.

    import distnorm.fusion
    pass_ = distnorm.fusion.allreduce_fusion_pass(ws)
    model = torch.compile(model, options={"post_grad_custom_pre_pass": pass_})

(as this compile's option: with torch._inductor.config set around a call instead, Dynamo may reuse
code compiled earlier for another instance of the model's class, and no pass runs)

graph_pass.py (the pass), match.py (what it recognises), op.py (the op it inserts), forms.py (the
plain-torch norm and quantization forms it recognises).
"""
from distnorm.fusion.forms import fp8_per_token_quant, fp8_static_quant, rms_norm_llama
from distnorm.fusion.graph_pass import AllReduceFusionPass, allreduce_fusion_pass

__all__ = ["allreduce_fusion_pass", "AllReduceFusionPass", "rms_norm_llama", "fp8_static_quant",
           "fp8_per_token_quant"]
