"""specfit.report"""
