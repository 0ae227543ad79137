"""The serving engine: many requests on one pipeline, one decoder step for every busy row, beside
the one-request loop (:mod:`higgs_pack.runtime.loop`) whose plans, prompts and checks it runs."""
