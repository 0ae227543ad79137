"""The PyTorch side: the sub-part modules that get exported (modules.py), the oracle
(reference.py), the matched oracle with a bundle's own weights read back (matched.py,
dequantize.py), and the golden outputs captured from them (golden.py).

Named ``pytorch``, not ``torch``: every module here does ``import torch``, and a sub-package of
that name would be one ``from higgs_pack.exporters import torch`` away from hiding it."""
