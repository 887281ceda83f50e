"""Drive a bundle's functions on this machine (`mopar run`): never imports torch or the compiler.

`local` runs a bundle (shm workers, or `chain`'s real function servers over http or redis),
`endpoint` serves it as one HTTP endpoint through those servers (``mopar serve``),
`worker` is the slice process the shm runner spawns, `bundle` is the runner's view of a bundle
(from its ``plan.json``, which `mopar.bundle` reads), `check` compares outputs with the
reference, and `report` holds what a run measured. A deployed function runs `mopar.runtime`
alone; this package imports it, never the reverse.
"""
