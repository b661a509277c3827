"""ccsq.producer"""
