"""Training loops: generic QAT Trainer, SteTrainer, PhaseTrainer."""
