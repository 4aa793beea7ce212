"""Reports written from finished runs: paper tables, figures, seed bands,
embedding purity and the FedDVA probes. Nothing below imports them.
"""
