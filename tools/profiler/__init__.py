"""The profiler's collection and training, beside the package: what measured and trained the
predictors mopar ships (``profiles/dataset.csv``, ``memory.json``, ``time.json``,
``predictors.json``) and the transports profile (``transports.json``).

Read in this order: `sweep` and `layers` (which samples: operators of `ops`, and the example
models' layers), `measure` with its child `probe` (memory and time under
onnxruntime), `collect` and `dataset` (the resumable CSV), `predict` and `train` (XGBoost, the
margin, the honest evaluation), `report` (the accuracy report's slices); `calibrate` measures
the transports, `speed` a target's CPU; `aggregate` holds the paper's chain, parallel and hybrid rules; `cli` holds the
``mopar profile`` commands of the checkout. Loading the predictors and predicting a model's
layers is `mopar.profile` (`store`, `features`, `service`).
"""
