"""specfit.calibrate"""
