"""LoRA adapters in the runner: PEFT adapters read and checked (`adapter`), the adapter slots on
the model's linears (`layers`), and the host cache and slot assignment per step (`manager`)."""
