"""ccsq.brokerd"""
