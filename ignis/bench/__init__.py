"""`ignis bench`: a serving benchmark against any OpenAI-compatible server, ignis or another.

Owns nothing itself; its modules own the workloads (.workloads), driving load and timing each request (.load),
summarising, writing and plotting results (.report), starting an `ignis serve` to measure (.server) and the command
(.cli). It measures through HTTP only, so the figures are what a client sees.
"""
