"""specfit.simulate"""
