"""The default pass pipeline, built from compile options.

A pipeline is a list of pass names resolved through the registry (`get_pass`), so this
module imports no pass directly: passes live one per file and register themselves.
`options.passes` (an explicit list of names) replaces the pipeline built here.
"""

from __future__ import annotations

from aviatorc.passes.manager import Pass, get_pass

from aviatorc.options import CompileOptions

# Identities first so that folding and fusion see producers and users directly; folding
# before dce because folding strands the constants it replaced.
CLEANUP: tuple[str, ...] = ("eliminate-identity", "fold-constants", "dce")
# After the rewrites there is nothing new to fold (the folder never folds DequantizeWeight,
# which would turn a quantized weight back into a float constant: ir/fold.py NEVER_FOLD).
# Only the stranded weights need removing.
FINAL_CLEANUP: tuple[str, ...] = ("eliminate-identity", "dce")


def pipeline_names(options: CompileOptions) -> list[str]:
    """The pass names `build_pipeline` resolves, in order."""
    if options.passes is not None:
        return list(options.passes)
    names = list(CLEANUP)  # the importer leaves shape subgraphs and identities behind
    if options.fuse_qkv:
        # Fuse while weights are still plain float initializers: fuse-qkv refuses weights
        # that already come through DequantizeWeight, and one fused matrix then gets one
        # set of sparsity masks and scales instead of three.
        names.append("fuse-qkv")
    if options.sparsity:
        # Prune before quantizing so that quantization scales are computed on the values
        # that are kept, not on the ones about to be zeroed.
        names.append("sparsify-2to4")
    if options.quant:
        names.append("quantize")
    names += FINAL_CLEANUP  # rewrites above leave the old weights unused
    return names


def build_pipeline(options: CompileOptions) -> list[Pass]:
    """The passes to run for `options`; an unknown name is an OptionError with a did-you-mean."""
    return [get_pass(name) for name in pipeline_names(options)]
