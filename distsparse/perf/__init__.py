"""Performance models built on what the code asks of the device (issue 25 item 5): `trace` records an op trace
(FLOPs and bytes per aten op, the collectives a rank issues), `roofline` turns it into an H200 time estimate."""
