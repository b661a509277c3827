"""ccsq.workerd"""
