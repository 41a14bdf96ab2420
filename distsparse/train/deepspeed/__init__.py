"""Everything the project knows about DeepSpeed (deepspeed==0.19.8, pinned), in one place:

    config.py       the DeepSpeed JSON of a run: the user's file checked against the run config and completed
    side.py         DeepSpeedSide: the dense side of the joint step, driven through the ZeRO-1/2 internals it needs,
                    and its model-state bytes
    dense_state.py  the dense side's fp32 masters and Adam moments by parameter name (gather and restore)
    checkpoint.py   the dense side as a checkpoint part: DeepSpeed's own files, the dense state by name, and the
                    same-partition or elastic load

Outside this package the project calls only DeepSpeed's public entry points (`deepspeed.initialize`,
`deepspeed.init_distributed`) and the engine as a module (forward, backward through the side, train/eval);
tests/test_deepspeed_boundary.py checks that nothing else reads DeepSpeed internals. Nothing is imported here:
config.py is read before any process group starts, where importing DeepSpeed would cost seconds.
"""
