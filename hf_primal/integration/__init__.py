"""How ``import hf_primal`` reaches into transformers: `patching` (the construction-time hooks, acting only on models
whose config asks for primal attention), `compat` (every transformers / torch internal hf_primal relies on,
checked at import), `hub` (Auto-class registration, remote-code export, saving shareable folders)."""
