from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description="Communication-efficient training extensions for megatron-core / Megatron-LM",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    package_data={"megatron_ext.kernels": ["csrc/*.c"]},  # built on first use (kernels/native.py)
    python_requires=">=3.10",
    # torch must be installed (pinned) before this package: see README.
    install_requires=["torch>=2.4", "megatron-core==0.16.1", "numpy", "tokenizers"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.8", "hypothesis", "triton", "psutil", "tensorboard"],
        "gpu": ["triton"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-ext-pretrain-gpt=megatron_ext.training.pretrain_gpt:main"]},
)
