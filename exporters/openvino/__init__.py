"""OpenVINO exporters: the stateful decoder (decoder.py), the static NPU decoder
(static_decoder.py), the small sub-parts (subpart.py, their static shapes in static_shapes.py),
IR helpers (ir.py), NNCF weight compression (compression.py) and the pass names, light
(plan.py: imports no OpenVINO).

Like ``runtime/backends/openvino``, the room is named for the format it writes; imports of the
``openvino`` package here are absolute and reach the real one."""
