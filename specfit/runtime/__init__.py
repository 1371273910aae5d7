"""specfit.runtime"""
