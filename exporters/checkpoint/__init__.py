"""The checkpoint: reading and checking a Higgs-Audio-v3 checkpoint (reader.py), its layout as data
(layout.py), the transformers models it becomes (models.py), the streaming safetensors writer and
the tiny random checkpoints of tests and benches (tiny.py, tiny_tokenizer.py)."""
