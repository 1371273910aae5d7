"""specfit.traces"""
