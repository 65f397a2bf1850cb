"""The planner: from hardware numbers and a model's architecture to a strategy, a speed and the reasons.

    hardware.py, hw_table.py   devices, node shapes, clusters; the published spec table with sources
    probe.py                   the only module that asks the machine anything (nvml, sysctl, /proc)
    catalog.py, model.py       published architectures; parameters counted per component
    source.py                  a GGUF/HF path, a catalog name or the default model -> ModelProfile
    formats.py                 weight and KV formats: bits, native compute dtype, dequantization cost
    memory.py                  what one device holds under a strategy
    calibration.py, cost.py    efficiency factors; decode-step and prefill time
    search.py, explain.py      strategy enumeration and choice; reasons, runners-up, smallest change
    plan.py, report.py         `make_plan` and its JSON; the readable report
    accuracy.py                predictions against docs/planner-accuracy.md

Everything here except probe.py is pure arithmetic and imports nothing heavy, so `twinfer plan` starts fast.
"""
