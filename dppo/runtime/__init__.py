"""The leaves every layer may use, with no dependency on training: model and tokenizer loading (`models`), the
hardware's dtype/engine choice (`hardware`), and crash-test fault points (`faults`).

Nothing here imports `dppo.rollout`, `dppo.train`, `dppo.studies` or `dppo.integrations`.
"""
