"""The deployment targets mopar ships, one package each, every package with the same modules
(`mopar.target` lists them and is the registry core code asks): ``openfaas`` (OpenFaaS on
Kubernetes) and ``aws_lambda`` (AWS Lambda). Nothing outside a target's package tests its name.
"""
