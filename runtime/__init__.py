"""The higgs-pack runtime: load a bundle and synthesize speech, with no torch."""
