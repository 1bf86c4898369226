"""The paper in miniature: the stability study (`sanity`), the mismatch diagnosis (`diagnose`), the SFT warm
start of the tiny model (`sft`) and the theory checks (`theory`). Uses the library and the trainer; nothing in
the library or the trainer uses it. (`dppo sft`, the warm start of an agent, is product: `dppo.train.sft`.)"""
