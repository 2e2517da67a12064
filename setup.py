from setuptools import find_packages, setup

setup(
    name="primuspipe",
    version="0.1.0",
    description="Pluggable pipeline-parallel schedule engine: algorithms, validator, runner, simulator",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["primuspipe", "primuspipe.*"]),
    install_requires=["networkx>=3.0", "PyYAML>=6.0", "rich>=13.0", "highspy>=1.7", "matplotlib>=3.7", "plotly>=5.0"],
    extras_require={
        "torch": ["torch>=2.6"],
        "megatron": ["torch>=2.6", "megatron-core>=0.19"],
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
    },
    entry_points={"console_scripts": ["primuspipe=primuspipe.cli:main"]},
)
