"""The study of a run: its analysis (the two phases, the machine, the estimates, every lever),
recomputed from the typed records on every read, and the checks of a lesson's claims. Below
report/, which only words and draws it."""
